"""Talking to the coordinator: the HTTP client (timeouts, retries, errors in words), joining as
oneself (the participant key), and what a joined participant keeps up in the background
(heartbeats, the event stream). See docs/architecture.md."""
