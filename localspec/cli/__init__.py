"""The ``localspec`` command line (one module per subcommand)."""
