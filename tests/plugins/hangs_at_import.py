"""A plugin whose import does not return (in time): the worker must veto it, and the parent never import it."""
import time

time.sleep(120)  # long past any test's import timeout; a parent that imported it anyway fails its test, slowly
