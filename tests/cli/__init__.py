"""Tests of the `specdec` command and its subcommands."""
