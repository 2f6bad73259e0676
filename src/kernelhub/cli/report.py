"""`kernelhub report`: which kernel each module of a model would get on each visible GPU.

The model is built on the meta device (no weights, no memory) from a transformers config:
`--model-config path/to/config.json` (`--config` is its deprecated spelling), `--model-type llama`
(transformers' defaults for that type), or `--checkpoint DIR` (a local checkpoint directory; only
its config.json is read). For each device
(`--device cuda:1`, repeatable; default every visible GPU, else cpu) it runs kernelize's resolution
for that device and prints the report: per module the device, capability, chosen repository and
layer, or why it falls back. `--capability 9.0` (repeatable) reports for a CUDA GPU of that
compute capability instead, which this machine need not have (so a CPU machine can answer "what
would an H100 get"). The kernelhub config (`--kernelhub-config`, default searched in the current
directory) applies as it would in `kernelize(model, config=...)`. A config with a
`quantization_config` (a pre-quantized checkpoint's, e.g. fp8) gets the modules `from_pretrained`
builds for it on a GPU machine (`FP8Experts`: layer MoEExpertsFP8).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from kernelhub.cli._common import add_deprecated_spelling, add_subcommand
from kernelhub.device import as_torch_device, device_capability

__all__ = ["add_parser", "build_meta_model", "report_model", "run"]


def _read_json(path: str, option: str):
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"report: `{option}` {path}: not valid UTF-8 JSON: {e}") from None
    except (RecursionError, MemoryError):  # the decoder recurses per nesting level
        raise ValueError(f"report: `{option}` {path}: not valid JSON: nested too deeply") from None


def _transformers_config(args):
    from transformers import AutoConfig

    if args.model_config:
        option = getattr(args, "model_config_option", "--model-config")  # the spelling the user typed
        data = _read_json(args.model_config, option)
        if not isinstance(data, dict):
            raise ValueError(f"report: `{option}` {args.model_config} must hold a JSON object (a transformers "
                             f"config), got {type(data).__name__}")
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"report: `{option}` {args.model_config} has no `model_type`")
        return AutoConfig.for_model(model_type, **data)
    if args.model_type:
        return AutoConfig.for_model(args.model_type)
    try:
        return AutoConfig.from_pretrained(args.checkpoint, local_files_only=True)
    except (RecursionError, MemoryError):  # its config.json, nested too deeply for the decoder
        raise ValueError(f"report: `--checkpoint` {args.checkpoint}: config.json is not valid JSON: nested too "
                         "deeply") from None


def build_meta_model(config) -> torch.nn.Module:
    """The model for a transformers config, on the meta device (a causal-LM head where the type has
    one), with the modules a pre-quantized checkpoint of that config loads as (e.g. `FP8Experts`)."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal-LM class for this type
            model = AutoModel.from_config(config)
        # inside the block: some quantizers build their modules' weights on the default device
        return _as_quantized(model, config)


def _as_quantized(model: torch.nn.Module, config) -> torch.nn.Module:
    """`model` with the modules `from_pretrained` swaps in for the config's `quantization_config`
    (fp8 checkpoints: `FP8Experts`, which kernelize serves with another layer than 16-bit experts),
    as on a GPU machine (transformers dequantizes fp8 on a machine without one). Unchanged, with a
    note, where this transformers cannot build them (a quantization library that is not installed)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return model
    try:
        from transformers.quantizers import AutoHfQuantizer

        AutoHfQuantizer.from_config(quantization, pre_quantized=True).preprocess_model(model)
    except Exception as e:  # noqa: BLE001 - report the unquantized modules rather than nothing
        print(f"report: note: the model's quantization_config could not be applied ({type(e).__name__}: {e}); "
              "reporting its unquantized modules", file=sys.stderr)
    return model


def _fp8_load_note(config, capability: int | None) -> str | None:
    """What transformers does with an fp8 checkpoint where the report assumes fp8 modules: it
    dequantizes at load on a GPU below sm89 (no fp8 tensor cores) or without a GPU, so a model
    loaded there has 16-bit experts (MoEExperts), not FP8Experts."""
    quantization = getattr(config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
        quantization, "quant_method", None)
    if str(getattr(method, "value", method)) != "fp8" or (capability is not None and capability >= 89):
        return None
    where = "without a GPU" if capability is None else f"on a GPU of capability {capability // 10}.{capability % 10}"
    return (f"report: note: transformers dequantizes an fp8 checkpoint when it is loaded {where}: its "
            "experts are then 16-bit (layer MoEExperts); the fp8 layers below serve fp8 experts that "
            "reach this device from a model loaded on an sm89+ GPU")


def _mode(name: str, compile_: bool):
    from kernelhub.mode import Mode

    mode = Mode.TRAINING if name == "training" else Mode.INFERENCE
    return mode | Mode.TORCH_COMPILE if compile_ else mode


def report_model(model: torch.nn.Module, devices: list[torch.device], *, mode, config=None) -> list[tuple]:
    """[(device, report)] from kernelize's resolution for each device; the model is left unkernelized."""
    import importlib

    kz = importlib.import_module("kernelhub.kernelize")  # the package re-exports the function under that name

    out = []
    for device in devices:
        if hasattr(kz, "plan"):
            report = kz.plan(model, mode=mode, device=device, config=config)
        else:
            kz.kernelize(model, mode=mode, device=device, config=config)
            report = kz.kernelize_report(model)
            kz.unkernelize(model)
        out.append((device, report))
    return out


def _devices(args) -> list[torch.device]:
    if args.device:
        devices = [as_torch_device(d, argument="--device") for d in args.device]
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for d in devices:
            if d.type == "cuda" and (d.index or 0) >= gpus:
                raise ValueError(f"report: `--device` {d}: this machine has {gpus} CUDA device(s); "
                                 "`--capability 9.0` reports for a GPU of that capability instead")
        return devices
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def _capability(text: str) -> int:
    match = re.fullmatch(r"(\d+)\.(\d)", text.strip())
    if match is None:
        raise ValueError(f"report: `--capability` must look like '9.0' or '8.6', got {text!r}")
    return int(match[1]) * 10 + int(match[2])


@contextlib.contextmanager
def _assumed_gpu(capability: int) -> Iterator[torch.device]:
    """A cuda device whose capability kernelize's resolution reads as `capability`: an index no
    real GPU has, answered from the device module's capability cache, forgotten afterwards."""
    from kernelhub import device as device_module

    key = ("cuda", 127)  # torch's largest device index (int8)
    with device_module._lock:
        device_module._capability_cache[key] = capability
    try:
        yield torch.device(*key)
    finally:
        device_module.clear_device_caches()


def add_parser(sub) -> None:
    p = add_subcommand(sub, "report", "show which kernel each module of a model gets on each GPU", __doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-config", help="transformers config.json")
    add_deprecated_spelling(src, "--config", "--model-config", "model_config")
    src.add_argument("--model-type", help="a transformers model type, e.g. llama, qwen3_moe, mixtral")
    src.add_argument("--checkpoint", help="local checkpoint directory (its config.json)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--device", action="append", help="device to report for, e.g. cuda:1 (repeatable)")
    where.add_argument("--capability", action="append",
                       help="report for a CUDA GPU of this compute capability, e.g. 9.0 (repeatable)")
    p.add_argument("--mode", choices=["inference", "training"], default="inference")
    p.add_argument("--compile", action="store_true", help="add Mode.TORCH_COMPILE")
    p.add_argument("--kernelhub-config", help="kernelhub.toml / pyproject.toml with [tool.kernelhub]")
    p.set_defaults(run=run)


def run(args) -> int:
    from kernelhub.config import load_config

    capabilities = [_capability(c) for c in args.capability or []]
    hf_config = _transformers_config(args)
    model = build_meta_model(hf_config)
    config = load_config(args.kernelhub_config)
    mode = _mode(args.mode, args.compile)
    for capability in capabilities:
        with _assumed_gpu(capability) as device:
            ((_, report),) = report_model(model, [device], mode=mode, config=config)
        print(f"== a CUDA GPU of capability {capability // 10}.{capability % 10} ==")
        note = _fp8_load_note(hf_config, capability)
        if note:
            print(note)
        # the assumed GPU's index is a placeholder no real GPU has: show it as one, not as cuda:127
        print(str(report).replace(str(device), "cuda:?".ljust(len(str(device)))))
    if capabilities:
        return 0
    devices = _devices(args)
    if not args.device and devices == [torch.device("cpu")]:
        print("no GPU visible: reporting for cpu")
    for device, report in report_model(model, devices, mode=mode, config=config):
        print(f"== {device} ==")
        note = _fp8_load_note(hf_config, device_capability(device) if device.type == "cuda" else None)
        if note:
            print(note)
        print(report)
    return 0
