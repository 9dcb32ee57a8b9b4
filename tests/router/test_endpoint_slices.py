"""EndpointSlices to endpoint URLs (router/endpoints.py), as the watch hands them to the fleet."""

from __future__ import annotations

from decodeservice.router.endpoints import merge_slices, slice_endpoints


def endpoint_slice(*endpoints: tuple[list[str], bool | None], family: str = "IPv4") -> dict[str, object]:
    return {"addressType": family, "endpoints": [
        {"addresses": addresses, **({} if ready is None else {"conditions": {"ready": ready}})}
        for addresses, ready in endpoints]}


def test_ready_and_unready_endpoints_of_a_slice() -> None:
    s = endpoint_slice((["10.0.0.1"], True), (["10.0.0.2"], False), (["10.0.0.3"], None))
    assert slice_endpoints(s, port=8000) == {"http://10.0.0.1:8000": True, "http://10.0.0.2:8000": False,
                                             "http://10.0.0.3:8000": True}  # no condition: ready, per the API
    assert slice_endpoints(endpoint_slice((["fd00::1"], True), family="IPv6"), port=8000) == {
        "http://[fd00::1]:8000": True}
    assert slice_endpoints({"addressType": "IPv4", "endpoints": None}, port=8000) == {}


def test_slices_merge_and_an_address_ready_in_either_is_ready() -> None:
    a = endpoint_slice((["10.0.0.1"], False), (["10.0.0.2"], True))
    b = endpoint_slice((["10.0.0.1"], True))
    assert merge_slices([a, b], port=9000) == {"http://10.0.0.1:9000": True, "http://10.0.0.2:9000": True}
