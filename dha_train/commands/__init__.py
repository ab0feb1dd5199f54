"""The `dha-train` sub-commands, one module each; every module has ``add_arguments(parser)``, which sets the
parser's ``func`` to the function that runs it. ``dha_train.cli`` imports only the one the command line names."""
