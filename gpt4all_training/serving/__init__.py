"""An OpenAI-compatible HTTP server over a model this project loads, decoding concurrent requests together
(`gpt4all-training serve`)."""
