"""A small local Hugging Face Hub: enough of its HTTP protocol for `huggingface_hub` 2.4.0 to publish,
list and download kernels in tests, with no network.

The real client is exercised end to end; only the server is ours. Endpoints follow what
`huggingface_hub` sends (see `hf_api.py`, `_commit_api.py`, `file_download.py`):

- `POST /api/repos/create`                        {name, organization, type, visibility}
- `GET  /api/organizations/{org}/overview`         with `trustedKernelPublisher` (`store.trusted_orgs`)
- `GET  /api/{type}s/{org}/{name}[/revision/{rev}]` repo info with `sha` and `siblings`
- `GET  /api/{type}s/{org}/{name}/refs`           branches and tags
- `GET  /api/{type}s/{org}/{name}/tree/{rev}[/{path}]?recursive=`
- `POST /api/{type}s/{org}/{name}/paths-info/{rev}`
- `POST /api/{type}s/{org}/{name}/preupload/{rev}` (every file is "regular": no LFS)
- `POST /api/{type}s/{org}/{name}/commit/{rev}`   NDJSON header + files
- `POST /api/{type}s/{org}/{name}/branch/{name}`  {startingPoint}
- `POST /api/{type}s/{org}/{name}/tag/{rev}`      {tag, message}
- `HEAD|GET /[{type}s/]{org}/{name}/resolve/{rev}/{path}` with `X-Repo-Commit` and `ETag`
Errors carry `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound) as the Hub's do.

Storage is git-like: blobs are content-addressed files (git blob sha1) in a directory, commits are
immutable snapshots {path: blob} with a parent, and branches/tags point at commits.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

_TYPE_PREFIXES = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class _Repo:
    repo_type: str
    repo_id: str
    private: bool
    commits: dict[str, dict] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class HubStore:
    """Repositories, commits and blobs; thread-safe."""

    def __init__(self, root: Path):
        self.root = Path(root)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self.repos: dict[tuple[str, str], _Repo] = {}
        self.lock = threading.Lock()
        self.counter = 0
        self.requests: list[tuple[str, str]] = []
        self.user_agents: list[str] = []  # one per request, in order
        # A hostile server, for tests: rewrite_json(endpoint, body) changes what an API call returns
        # ("revision", "refs", "tree", "paths-info"); rewrite_file(method, path, data, headers) changes
        # a file's bytes and headers as HEAD describes them or GET sends them.
        self.trusted_orgs: set[str] = set()  # organizations the Hub marks trustedKernelPublisher
        self.rewrite_json = None
        self.rewrite_file = None

    # blobs and commits ------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> str:
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        path = self.root / "blobs" / oid
        if not path.exists():
            path.write_bytes(data)
        return oid

    def blob(self, oid: str) -> bytes:
        return (self.root / "blobs" / oid).read_bytes()

    def _new_commit(self, repo: _Repo, parent: str | None, files: dict[str, str], message: str) -> str:
        self.counter += 1
        body = json.dumps([parent, sorted(files.items()), message, self.counter]).encode()
        oid = hashlib.sha1(body).hexdigest()
        repo.commits[oid] = {"parent": parent, "files": dict(files), "message": message}
        return oid

    # lookups ----------------------------------------------------------------------------------
    def repo(self, repo_type: str, repo_id: str) -> _Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise _HubError(404, "RepoNotFound", f"Repository Not Found for url: {repo_type} {repo_id}.")
        return repo

    def resolve(self, repo: _Repo, revision: str) -> str:
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.tags:
            return repo.tags[revision]
        if _COMMIT_RE.match(revision) and revision in repo.commits:
            return revision
        raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    # writes -----------------------------------------------------------------------------------
    def create_repo(self, repo_type: str, repo_id: str, private: bool) -> bool:
        with self.lock:
            if (repo_type, repo_id) in self.repos:
                return False
            repo = _Repo(repo_type, repo_id, private)
            attrs = self.put_blob(b"*.so filter=lfs diff=lfs merge=lfs -text\n")
            repo.branches["main"] = self._new_commit(repo, None, {".gitattributes": attrs}, "initial commit")
            self.repos[(repo_type, repo_id)] = repo
            return True

    def commit(self, repo: _Repo, branch: str, ops: list[dict], message: str, parent: str | None) -> str:
        with self.lock:
            if branch not in repo.branches:
                raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {branch}")
            head = repo.branches[branch]
            if parent is not None and parent != head:
                raise _HubError(412, None, f"A commit has happened since. Parent {parent} is not head {head}")
            files = dict(repo.commits[head]["files"])
            for op in ops:
                if op["key"] == "file":
                    value = op["value"]
                    data = (
                        base64.b64decode(value["content"])
                        if value.get("encoding") == "base64"
                        else (value["content"].encode())
                    )
                    files[value["path"]] = self.put_blob(data)
                elif op["key"] == "deletedFile":
                    files.pop(op["value"]["path"], None)
                elif op["key"] == "deletedFolder":
                    prefix = op["value"]["path"].rstrip("/") + "/"
                    files = {p: o for p, o in files.items() if not p.startswith(prefix)}
                else:
                    raise _HubError(400, None, f"unsupported commit operation {op['key']!r}")
            oid = self._new_commit(repo, head, files, message)
            repo.branches[branch] = oid
            return oid


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - keep the test output quiet
        pass

    # plumbing ---------------------------------------------------------------------------------
    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict[str, str] | None = None, endpoint: str | None = None) -> None:
        rewrite = self.server.store.rewrite_json
        if endpoint is not None and rewrite is not None:
            obj = rewrite(endpoint, obj)
        self._send(status, json.dumps(obj).encode(), headers)

    def _body(self) -> bytes:
        return self._raw

    def _dispatch(self) -> None:
        store = self.server.store
        url = urlsplit(self.path)
        store.requests.append((self.command, url.path))
        store.user_agents.append(self.headers.get("User-Agent", ""))
        n = int(self.headers.get("Content-Length") or 0)
        self._raw = self.rfile.read(n) if n else b""  # always drain: the connection is kept alive
        try:
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            if parts[:1] == ["api"]:
                self._api(parts[1:], parse_qs(url.query))
            else:
                self._resolve(parts)
        except _HubError as e:
            headers = {"X-Error-Message": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
            if e.commit:
                headers["X-Repo-Commit"] = e.commit
            self._json(e.status, {"error": e.message}, headers)

    do_GET = do_POST = do_HEAD = _dispatch

    # file downloads ---------------------------------------------------------------------------
    def _resolve(self, parts: list[str]) -> None:
        repo_type = "model"
        if parts and parts[0] in _TYPE_PREFIXES:
            repo_type = _TYPE_PREFIXES[parts.pop(0)]
        if len(parts) < 5 or parts[2] != "resolve":
            raise _HubError(404, None, f"not found: {self.path}")
        store = self.server.store
        repo = store.repo(repo_type, f"{parts[0]}/{parts[1]}")
        commit = store.resolve(repo, parts[3])
        filename = "/".join(parts[4:])
        oid = repo.commits[commit]["files"].get(filename)
        if oid is None:
            raise _HubError(404, "EntryNotFound", f"{filename} does not exist at {commit}", commit=commit)
        data = store.blob(oid)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{oid}"'}
        if store.rewrite_file is not None:
            data, headers = store.rewrite_file(self.command, filename, data, headers)
        self._send(200, data, headers, "application/octet-stream")

    # API --------------------------------------------------------------------------------------
    def _api(self, parts: list[str], query: dict) -> None:
        store = self.server.store
        if parts == ["validate-yaml"]:  # README front matter check before a commit
            self._json(200, {"errors": [], "warnings": []})
            return
        if parts == ["repos", "create"] and self.command == "POST":
            payload = json.loads(self._body() or b"{}")
            repo_type = payload.get("type") or "model"
            repo_id = f"{payload['organization']}/{payload['name']}"
            private = payload.get("visibility") == "private" or bool(payload.get("private"))
            prefix = "" if repo_type == "model" else f"{repo_type}s/"
            url = f"http://{self.headers['Host']}/{prefix}{repo_id}"
            if not store.create_repo(repo_type, repo_id, private):
                self._json(409, {"error": "You already created this repo", "url": url})
            else:
                self._json(200, {"url": url})
            return
        if len(parts) == 3 and parts[0] == "organizations" and parts[2] == "overview":
            org = parts[1]
            if org not in store.trusted_orgs and not any(r.split("/")[0] == org for _, r in store.repos):
                raise _HubError(404, None, f"Organization {org} not found")
            self._json(200, {"name": org, "fullname": org, "trustedKernelPublisher": org in store.trusted_orgs})
            return
        if len(parts) < 3 or parts[0] not in _TYPE_PREFIXES:
            raise _HubError(404, None, f"unknown endpoint {self.path}")
        repo_type = _TYPE_PREFIXES[parts[0]]
        repo = store.repo(repo_type, f"{parts[1]}/{parts[2]}")
        action, rest = (parts[3], parts[4:]) if len(parts) > 3 else ("revision", ["main"])
        handler = getattr(self, f"_api_{action.replace('-', '_')}", None)
        if handler is None:
            raise _HubError(404, None, f"unknown endpoint {self.path}")
        handler(repo, rest, query)

    def _api_revision(self, repo: _Repo, rest: list[str], query: dict) -> None:
        commit = self.server.store.resolve(repo, "/".join(rest))
        files = repo.commits[commit]["files"]
        self._json(
            200,
            {
                "id": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": commit,
                "private": repo.private,
                "siblings": [{"rfilename": p} for p in sorted(files)],
            },
            endpoint="revision",
        )

    def _api_refs(self, repo: _Repo, rest: list[str], query: dict) -> None:
        def refs(kind: str, table: dict[str, str]) -> list[dict]:
            return [
                {"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": c} for n, c in sorted(table.items())
            ]

        self._json(
            200,
            {
                "branches": refs("heads", repo.branches),
                "tags": refs("tags", repo.tags),
                "converts": [],
                "pullRequests": [],
            },
            endpoint="refs",
        )

    def _entries(self, repo: _Repo, commit: str, prefix: str, recursive: bool) -> list[dict]:
        store = self.server.store
        files = repo.commits[commit]["files"]
        base = prefix.strip("/") + "/" if prefix.strip("/") else ""
        out: dict[str, dict] = {}
        for path, oid in sorted(files.items()):
            if not path.startswith(base):
                continue
            tail = path[len(base) :].split("/")
            for depth in range(1, len(tail)):
                folder = base + "/".join(tail[:depth])
                if recursive or depth == 1:
                    out.setdefault(
                        folder,
                        {
                            "type": "directory",
                            "oid": hashlib.sha1(folder.encode()).hexdigest(),
                            "path": folder,
                        },
                    )
            if recursive or len(tail) == 1:
                out[path] = {"type": "file", "oid": oid, "size": len(store.blob(oid)), "path": path}
        if base and not out:
            raise _HubError(404, "EntryNotFound", f"{prefix} does not exist at {commit}", commit=commit)
        return list(out.values())

    def _api_tree(self, repo: _Repo, rest: list[str], query: dict) -> None:
        commit = self.server.store.resolve(repo, rest[0])
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        self._json(200, self._entries(repo, commit, "/".join(rest[1:]), recursive), endpoint="tree")

    def _api_paths_info(self, repo: _Repo, rest: list[str], query: dict) -> None:
        commit = self.server.store.resolve(repo, "/".join(rest))
        form = parse_qs(self._body().decode())
        wanted = set(form.get("paths", []))
        entries = [e for e in self._entries(repo, commit, "", True) if e["path"] in wanted]
        self._json(200, entries, endpoint="paths-info")

    def _api_preupload(self, repo: _Repo, rest: list[str], query: dict) -> None:
        self.server.store.resolve(repo, "/".join(rest))
        payload = json.loads(self._body())
        files = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in payload["files"]
        ]
        self._json(200, {"files": files, "commitOid": None})

    def _api_commit(self, repo: _Repo, rest: list[str], query: dict) -> None:
        branch = "/".join(rest)
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        header = next((x["value"] for x in lines if x["key"] == "header"), {})
        ops = [x for x in lines if x["key"] != "header"]
        oid = self.server.store.commit(
            repo, branch, ops, header.get("summary", ""), header.get("parentCommit")
        )
        host = self.headers["Host"]
        self._json(
            200,
            {
                "commitUrl": f"http://{host}/{repo.repo_id}/commit/{oid}",
                "commitOid": oid,
                "pullRequestUrl": None,
                "success": True,
            },
        )

    def _api_branch(self, repo: _Repo, rest: list[str], query: dict) -> None:
        store = self.server.store
        name = "/".join(rest)
        payload = json.loads(self._body() or b"{}")
        with store.lock:
            if name in repo.branches:
                raise _HubError(409, None, f"Reference already exists: refs/heads/{name}")
            start = store.resolve(repo, payload.get("startingPoint") or "main")
            repo.branches[name] = start
        self._json(200, {})

    def _api_tag(self, repo: _Repo, rest: list[str], query: dict) -> None:
        store = self.server.store
        payload = json.loads(self._body() or b"{}")
        with store.lock:
            commit = store.resolve(repo, "/".join(rest))
            if payload["tag"] in repo.tags:
                raise _HubError(409, None, f"Tag already exists: refs/tags/{payload['tag']}")
            repo.tags[payload["tag"]] = commit
        self._json(200, {})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, store: HubStore):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.store = store


class LocalHub:
    """Run a local Hub on 127.0.0.1 (a free port) in a thread: `with LocalHub(tmp) as hub: hub.url`."""

    def __init__(self, root: Path):
        self.store = HubStore(root)
        self._server = _Server(self.store)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> LocalHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- pytest fixtures (import into a test module: `from hub_server import hub_fixture`) -------
TINY = Path(__file__).resolve().parent / "fixtures" / "kernels" / "tiny"

try:
    import pytest
except ImportError:  # the server also runs by hand without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(name="hub")
    def hub_fixture(tmp_path, monkeypatch):
        """A LocalHub for this test; HF_ENDPOINT and HF_HUB_CACHE point the Hub client at it."""
        for var in (
            "KERNELHUB_CACHE",
            "HF_HUB_OFFLINE",
            "KERNELHUB_TRUSTED_PUBLISHERS",
            "KERNELHUB_LOCKFILE",
            "KERNELHUB_REPO_TYPE",
            "HF_TOKEN",
        ):
            monkeypatch.delenv(var, raising=False)
        with LocalHub(tmp_path / "hubdata") as server:
            monkeypatch.setenv("HF_ENDPOINT", server.url)
            monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
            yield server


def tiny_copy(
    dest: Path, *, factor: float = 2.0, extra_variants: dict[str, float] | None = None, universal: bool = True
) -> Path:
    """A copy of the tiny kernel repo whose `scale` multiplies by `factor` (to tell versions apart).

    `extra_variants` adds build variants (name -> factor) holding the same package.
    """
    import shutil

    shutil.copytree(TINY, dest, ignore=shutil.ignore_patterns("__pycache__"))
    src = dest / "build" / "torch-universal"
    for name, f in (extra_variants or {}).items():
        shutil.copytree(src, dest / "build" / name)
        _set_factor(dest / "build" / name / "tiny" / "ops.py", f)
    _set_factor(src / "tiny" / "ops.py", factor)
    if not universal:
        shutil.rmtree(src)
    return dest


def _set_factor(ops: Path, factor: float) -> None:
    text = ops.read_text()
    ops.write_text(re.sub(r"^FACTOR = .*$", f"FACTOR = {float(factor)!r}", text, flags=re.M))


if __name__ == "__main__":  # run a hub by hand: python tests/hub_server.py /tmp/hubdata
    import sys
    import time

    with LocalHub(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kernelhub-hub")) as hub:
        print(hub.url, flush=True)
        while True:
            time.sleep(3600)
