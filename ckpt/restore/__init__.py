"""The restore path below its use case: lazy restores (page server, watcher), PID namespaces."""
