"""serve-app: multi-tenant OpenAI-compatible LLM serving on Ray Serve and vLLM."""

__version__ = "0.1.0"
