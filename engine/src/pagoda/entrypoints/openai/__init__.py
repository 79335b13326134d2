"""OpenAI-compatible HTTP server: request/response models, error bodies, API-key auth and the app itself."""
