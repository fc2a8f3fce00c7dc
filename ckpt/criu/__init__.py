"""The only package that imports pycriu. Everything CRIU-specific lives here."""
