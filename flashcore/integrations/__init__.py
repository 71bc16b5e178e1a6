"""Optional integrations of flashcore with other libraries.

Each submodule imports its library when it is itself imported, never before: ``import flashcore`` (and importing
this package) imports none of them.

    import flashcore.integrations.transformers   # registers attn_implementation="fcore" with Hugging Face transformers
"""
