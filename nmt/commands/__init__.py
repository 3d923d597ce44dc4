"""The bodies of the commands other than training, which the command line (nmt.cli) calls."""
