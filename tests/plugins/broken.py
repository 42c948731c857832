"""A plugin file that fails to import: the harness reports it as an error row."""
raise ImportError("this plugin is broken on purpose")
