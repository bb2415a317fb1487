"""The ``flowrl`` command line: one module per subcommand, dispatched by ``flowrl.cli.main``."""

__all__: list[str] = []
