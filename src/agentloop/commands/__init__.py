"""Subcommands of the `agentloop` command, one module each."""
