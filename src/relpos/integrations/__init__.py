"""Bridges to other frameworks (optional extras): ``relpos.integrations.transformers``."""
