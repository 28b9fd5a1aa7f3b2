"""The ``switchyard`` command."""
