"""GPU tests of the CUDA backend (a package, so that its conftest does not shadow tests/conftest.py)."""
