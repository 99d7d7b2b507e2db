"""The node toolkit's command line: app (the edge: parsing, errors, exit codes), one module per command group."""
