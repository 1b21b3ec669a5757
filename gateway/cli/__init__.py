"""The ``prefixgate`` command. Each ``*_cmd`` module in this package registers its subcommands."""
