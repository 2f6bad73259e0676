"""Hugging Face `kernels` 0.17 test suite, ported to kernelhub (see conftest.py)."""
