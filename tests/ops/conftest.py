import pytest

from hybridlm.ops.native import built_for, isa_levels


@pytest.fixture(params=isa_levels())
def isa(request):
    """Runs the test once per ISA level this CPU executes (x86-64-v2: the portable vector code;
    x86-64-v3: AVX2 + FMA + F16C; x86-64-v4: AVX-512; native: everything it has), every kernel built
    with that ``-march``: a machine of one kind checks the code paths of the others."""
    with built_for(request.param):
        yield request.param
