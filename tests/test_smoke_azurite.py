from azure.storage.blob import BlobServiceClient


def test_azurite_roundtrip(azurite_container):
    conn, name = azurite_container
    c = BlobServiceClient.from_connection_string(conn).get_container_client(name)
    c.upload_blob("a/b", b"hello")
    assert c.download_blob("a/b").readall() == b"hello"
