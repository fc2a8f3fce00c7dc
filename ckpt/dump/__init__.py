"""The dump path below its use case: pre-flight helpers, dirty tracking, read-ahead, options, commit."""
