"""jspec: lossless DSpark speculative decoding for Qwen3 in JAX."""

from pathlib import Path as _Path

# In a source checkout kernels/ and convert/ sit beside jspec/; installed, they live inside it
# (pyproject maps them). Let a checkout import jspec.kernels / jspec.convert without installing.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "kernels" / "__init__.py").is_file():
    __path__.append(str(_root))
del _Path, _root


def __getattr__(name):
    # `from jspec import LLM, SamplingParams` without importing JAX on `import jspec`.
    if name in ("LLM", "SamplingParams", "GenerationResult"):
        from jspec import api
        return getattr(api, name)
    raise AttributeError(f"module 'jspec' has no attribute {name!r}")
