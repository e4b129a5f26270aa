"""Translations of the APIs LLM clients call (OpenAI, Cohere, Jina) onto the frontend's
KServe calls: ``openai`` and ``rerank``, pure functions; the HTTP shell routes them
(``fair_frontend.shell.api_http``)."""
