"""Serving beyond one process: one signaling entry in front of worker processes placed by Ray.

Each worker is the single-process server core (engine, media, its own HTTP port) inside a Ray
actor, one per GPU or per configured slot group. The entry forwards each offer to the least-loaded
worker with a free slot and every follow-up to the worker named in the session id; media goes
straight between the client and that worker. Nothing here is imported by ``lychee-rtc serve``; Ray
comes with the ``cluster`` extra.
"""
