"""Who may call a service, and what a call must look like before any work is done for it.

files.py   files that may be replaced while the service runs (Kubernetes Secret rotation)
tls.py     TLS and mutual TLS: the server's credentials (reloaded on rotation) and the client's
tokens.py  bearer tokens: who a caller is, by a constant-time compare
guard.py   the server interceptor that applies all of it to every call
"""
