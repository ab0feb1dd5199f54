"""Conversion library below the commands: turning a source model into cheaper attention and fitting it back.

``refit``: the calibration-only closed-form refit of a converted model to its source (``dha-train refit``).
"""
