"""Ray Serve application: OpenAI-compatible HTTP ingress, global router, XP instances."""
