"""Importers: checkpoints in other projects' layouts turned into a spec and specc's weights file.

One subpackage per source layout (hf: a Hugging Face checkpoint folder). They sit above nn/ and
weights/ and below the CLI: nothing else in specc imports them.
"""
