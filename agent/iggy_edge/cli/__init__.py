"""The `iggy-edge` command line (typer), one module per command group."""
