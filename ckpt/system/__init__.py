"""Facts about processes (/proc), netlink sock_diag, and the low-level helpers everything shares."""
