"""The coordinator's HTTP routes, one `APIRouter` a module, each area in its own file.

`deps` holds what every router shares: the service of the app (from `app.state`), the
dependencies that authenticate and authorize a request, and the server's streaming hooks.
The routers: `dashboard` (the page, `/v1`, `/v1/whoami`, `/metrics`), `participants`
(join, heartbeat, leave, reported metrics), `config` (the live config and its history),
`admin` (tokens, evictions, kept versions, roll backs), `observability` (health, status,
events, metrics, the event stream) and `rounds` (round status, uploads, model downloads).
`coordinator/app.py` puts them together with the error handlers and the middleware.
"""
