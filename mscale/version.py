"""The package's version, written once (pyproject reads it; `mscale.__version__` re-exports
it). A leaf: modules that record the version import it from here, not from the package's
__init__, which names the hook library's modules."""

__version__ = "0.1.0"
