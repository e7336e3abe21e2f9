"""Integrations of bamgen's generated attention into other frameworks.

``bamgen.integrations.transformers``: a prior inside a Hugging Face model (``pip install
'bamgen[hf]'``); docs/huggingface.md.
"""
