"""Call recording: the caller and what the caller heard, on one clock, written as the call goes."""
