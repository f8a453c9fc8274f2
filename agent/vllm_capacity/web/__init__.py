"""The sidecar's web listener: the aiohttp app (:mod:`.app`), the connection guard (:mod:`.listener`) with its TLS
layer (:mod:`.tls`), and ``--web.config.file`` (:mod:`.config`)."""
