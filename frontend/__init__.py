"""The API-server process: engine client, output processing, OpenAI routes (never imports torch)."""
