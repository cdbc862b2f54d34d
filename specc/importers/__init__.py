"""Importers: checkpoints in other projects' layouts turned into a spec and specc's weights file.

        families/ (one module per family: its Hugging Face table, config.json inverse, GGUF rows)
            written in table.py, gguftable.py, rope.py, layers.py; refusing with errors.py
        hf/       a Hugging Face checkpoint folder (and a spec written back as config.json)
        gguf.py   a llama.cpp GGUF file, read into the Hugging Face form, written by hf's writer

They sit above nn/ and weights/ and below the CLI and the build: nothing else in specc imports them
but specc.builder.clients (config.json, through hf/as_config.py).
"""
