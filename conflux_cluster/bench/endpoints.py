"""The OpenAI routes ``conflux bench`` can load (no imports: the CLI reads them when it builds its parser)."""

COMPLETIONS = "/v1/completions"  # token-id or text prompts
CHAT = "/v1/chat/completions"  # text prompts, one user message each
ENDPOINTS = (COMPLETIONS, CHAT)
