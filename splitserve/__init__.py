"""splitserve: LLM serving with prefill/decode disaggregation."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("splitserve")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0.0.0+unknown"
