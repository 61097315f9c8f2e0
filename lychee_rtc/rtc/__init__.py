"""WebRTC: offers and answers, resume, trickle ICE, and the media and data-channel plumbing of aiortc."""
