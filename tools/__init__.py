"""Developer tools for the spool project (not installed with the package)."""
