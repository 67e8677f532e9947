from scaletrain.cli import entry

entry()
