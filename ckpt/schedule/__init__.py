"""Scheduled checkpoints: cron expressions, crontab entries, retention, hooks."""
