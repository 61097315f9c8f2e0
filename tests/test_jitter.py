"""The low-latency jitter buffer: no added delay in order, and none kept after a loss."""

from aiortc.rtp import RtpPacket

from lychee_rtc.rtc.jitter import LowLatencyJitterBuffer


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def packet(seq: int) -> RtpPacket:
    p = RtpPacket(payload_type=111, sequence_number=seq % 65536, timestamp=(seq * 960) % 2**32)
    p._data = bytes([seq % 256])
    return p


def run(seqs, clock, jb, step=0.02):
    released = []
    for s in seqs:
        clock.t += step
        released.append([f.timestamp // 960 for f in jb.add(packet(s))])
    return released


def test_in_order_packets_are_released_at_once():
    clock = FakeClock()
    jb = LowLatencyJitterBuffer(0.04, clock)
    assert run(range(65530, 65546), clock, jb) == [[s] for s in range(65530, 65546)]


def test_reordering_is_repaired_without_loss():
    clock = FakeClock()
    jb = LowLatencyJitterBuffer(0.04, clock)
    assert run([0, 2, 1, 3], clock, jb) == [[0], [], [1, 2], [3]]
    assert jb.counters.lost == 0


def test_loss_is_given_up_quickly_and_no_delay_is_kept():
    clock = FakeClock()
    jb = LowLatencyJitterBuffer(0.04, clock)
    out = run([0, 1, 3, 4, 5, 6, 7], clock, jb)  # 2 is lost
    assert out[:2] == [[0], [1]]
    # 3 waits while 2 might still come; after 40 ms everything waiting goes out together...
    assert out[2] == [] and sorted(sum(out[3:5], [])) == [3, 4, 5]
    # ...and from then on every packet is released the moment it arrives: the depth is back to zero.
    assert out[5:] == [[6], [7]]
    assert jb.counters.lost == 1
    # The lost packet turning up late is dropped, not played out of order.
    assert jb.add(packet(2)) == [] and jb.counters.late == 1


def test_burst_loss_and_sender_restart():
    clock = FakeClock()
    jb = LowLatencyJitterBuffer(0.04, clock)
    run(range(10), clock, jb)
    out = run([15, 16, 17, 18], clock, jb)  # 10..14 lost
    assert sum(out, []) == [15, 16, 17, 18]
    assert jb.counters.lost == 5
    out = run([30000, 30001], clock, jb)  # a jump far beyond any loss: a new stream
    assert out == [[30000], [30001]] and jb.counters.resets == 1


def test_a_stray_old_packet_does_not_reset_the_stream():
    clock = FakeClock()
    jb = LowLatencyJitterBuffer(0.04, clock)
    run(range(300), clock, jb)
    assert run([50], clock, jb) == [[]]  # a replayed or very late packet: dropped, no reset
    assert jb.counters.resets == 0 and jb.counters.late == 1
    assert run([300, 301], clock, jb) == [[300], [301]]
    # A sender that really restarted further back keeps sending from there: accepted after a few.
    out = run([40 + k for k in range(5)], clock, jb)
    assert jb.counters.resets == 1 and sum(out, []) != []


def test_the_timer_gives_up_on_a_missing_packet_without_new_arrivals():
    clock = FakeClock()
    jb = LowLatencyJitterBuffer(0.04, clock)
    run([0, 2, 3], clock, jb)  # 1 is lost and then the talk spurt ends
    assert jb.waiting
    clock.t += 0.05
    assert [f.timestamp // 960 for f in jb.release_due()] == [2, 3]
    assert not jb.waiting and jb.counters.lost == 1
