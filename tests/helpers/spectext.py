"""Spec texts shared by the tests (`from tests.helpers.spectext import DEC`)."""

# the smallest valid decoder; tests change one line of it at a time
DEC = """\
specc: 1
name: t
architecture: decoder
d_model: 64
vocab:
  size: 100
decoder:
  layers: 2
  attention:
    heads: 4
"""
