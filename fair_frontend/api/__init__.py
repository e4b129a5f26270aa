"""Translations of the APIs LLM clients call (OpenAI, Cohere, Jina) onto the frontend's KServe
calls."""
