"""Adapters that plug flashattn into other libraries.

Each submodule imports its library lazily, on import of the submodule, so
``import flashattn`` never needs them: :mod:`flashattn.integrations.transformers`
registers an attention backend with Hugging Face Transformers.
"""
