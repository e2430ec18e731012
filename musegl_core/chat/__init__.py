"""The text protocol: chat messages, the Muse template, the channel parser."""
