"""The version of the package, in one place: ``pyproject.toml`` reads it from here
(setuptools' ``attr:``, read without importing the package) and ``spool --version`` shows it."""

__version__ = "0.1.0"
