from tests.service.router.conftest import mesh  # noqa: F401 (a real router over fake workers)
