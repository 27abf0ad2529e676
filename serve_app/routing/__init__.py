"""How much work the router releases to a model's engines: admission capacity policies."""
