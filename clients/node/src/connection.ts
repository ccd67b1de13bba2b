// Channel credentials, options and targets of a kvmesh server for @grpc/grpc-js:
// TLS (server, mutual, certificate files watched for rotation), bearer tokens,
// several replicas as one target, and the load-balancing policy over them.

import * as fs from 'node:fs';
import * as grpc from '@grpc/grpc-js';

/** TLS of a connection: the server's CA, this client's certificate, the name to check. */
export interface TlsOptions {
  /** PEM CA bundle that signs the server's certificate (a file, or the PEM itself). */
  caFile?: string;
  ca?: Buffer;
  /** This client's certificate and key (mutual TLS). */
  certFile?: string;
  keyFile?: string;
  cert?: Buffer;
  key?: Buffer;
  /** Name the server certificate must carry (sent as SNI), instead of the address's host. */
  serverName?: string;
  /** Re-read caFile, certFile and keyFile this often; new connections use the files as they are then. */
  reloadIntervalMs?: number;
}

/** How to reach a kvmesh server. */
export interface ConnectionOptions {
  /** `true` (system CA roots) or the TLS settings; absent: plaintext. */
  tls?: true | TlsOptions;
  /** Bearer token sent as `authorization: Bearer <token>` call credentials (needs `tls`). */
  token?: string;
  /** File holding the bearer token, read again whenever it changes (needs `tls`). */
  tokenFile?: string;
  /** `'round_robin'` (default: every ready replica in turn) or `'pick_first'`. */
  loadBalancing?: 'round_robin' | 'pick_first';
  /** Further grpc-js channel options (a `grpc.service_config` here wins over `loadBalancing`). */
  channelOptions?: grpc.ChannelOptions;
}

/** What `connection` returns: what `new grpc.Client(target, ...)` takes. */
export interface Connection {
  credentials: grpc.ChannelCredentials;
  channelOptions: grpc.ChannelOptions;
}

/** Read a PEM file, naming the option in the error. */
function readPem(file: string, what: string): Buffer {
  let data: Buffer;
  try {
    data = fs.readFileSync(file);
  } catch (err) {
    throw new Error(`cannot read ${what} ${JSON.stringify(file)}: ${(err as Error).message}`);
  }
  if (!data.includes('-----BEGIN')) throw new Error(`${what} ${JSON.stringify(file)} is not PEM`);
  return data;
}

/**
 * A function returning the bearer token: `token` as given, or the content of
 * `tokenFile`, read again whenever the file changes (a rotated Secret).
 */
function tokenSource(token: string | undefined, tokenFile: string | undefined): () => string {
  if (token) return () => token;
  const file = tokenFile as string;
  let stamp = '';
  let current = '';
  const read = (): string => {
    const st = fs.statSync(file);
    const now = `${st.mtimeMs}/${st.ctimeMs}/${st.ino}/${st.size}`;
    if (now !== stamp) {
      const value = fs.readFileSync(file, 'utf8').trim();
      if (!value) throw new Error(`tokenFile ${JSON.stringify(file)} is empty`);
      current = value;
      stamp = now;
    }
    return current;
  };
  read(); // fail now, naming the file, rather than on the first call
  return read;
}

/**
 * Channel credentials and options for a kvmesh server. Without `tls` and a
 * token the channel is plaintext; a token without `tls` is refused (kvmesh
 * servers ignore a token that arrives in plaintext).
 */
export function connection(options: ConnectionOptions = {}): Connection {
  const { tls, token, tokenFile } = options;
  const policy = options.loadBalancing || 'round_robin';
  if (!['round_robin', 'pick_first'].includes(policy)) {
    throw new Error(`loadBalancing: ${JSON.stringify(policy)} is neither round_robin nor pick_first`);
  }
  const channelOptions: grpc.ChannelOptions = {
    'grpc.service_config': JSON.stringify({ loadBalancingConfig: [{ [policy]: {} }] }),
    ...(options.channelOptions || {}),
  };
  if (!tls) {
    if (token || tokenFile) throw new Error('a bearer token needs tls (it is never sent in plaintext)');
    return { credentials: grpc.credentials.createInsecure(), channelOptions };
  }
  const t: TlsOptions = tls === true ? {} : tls;
  if (Boolean(t.certFile || t.cert) !== Boolean(t.keyFile || t.key)) {
    throw new Error('tls: a client certificate needs its key, and a key its certificate');
  }
  let credentials: grpc.ChannelCredentials;
  if (t.reloadIntervalMs) {
    if (!t.caFile) throw new Error('tls.reloadIntervalMs needs tls.caFile (and files, not PEM values)');
    // Read once here so that a wrong path fails now rather than on every connection.
    readPem(t.caFile, 'tls.caFile');
    if (t.certFile && t.keyFile) {
      readPem(t.certFile, 'tls.certFile');
      readPem(t.keyFile, 'tls.keyFile');
    }
    const { FileWatcherCertificateProvider, createCertificateProviderChannelCredentials } = grpc.experimental;
    const caProvider = new FileWatcherCertificateProvider({
      caCertificateFile: t.caFile,
      refreshIntervalMs: t.reloadIntervalMs,
    });
    const identityProvider =
      t.certFile && t.keyFile
        ? new FileWatcherCertificateProvider({
            certificateFile: t.certFile,
            privateKeyFile: t.keyFile,
            refreshIntervalMs: t.reloadIntervalMs,
          })
        : null;
    credentials = createCertificateProviderChannelCredentials(caProvider, identityProvider);
  } else {
    const ca = t.ca || (t.caFile ? readPem(t.caFile, 'tls.caFile') : null);
    const cert = t.cert || (t.certFile ? readPem(t.certFile, 'tls.certFile') : null);
    const key = t.key || (t.keyFile ? readPem(t.keyFile, 'tls.keyFile') : null);
    credentials = grpc.credentials.createSsl(ca, key, cert);
  }
  if (t.serverName) {
    channelOptions['grpc.ssl_target_name_override'] = t.serverName;
    channelOptions['grpc.default_authority'] = t.serverName;
  }
  if (token || tokenFile) {
    const current = tokenSource(token, tokenFile);
    const bearer = grpc.credentials.createFromMetadataGenerator((_params, callback) => {
      try {
        const md = new grpc.Metadata();
        md.set('authorization', `Bearer ${current()}`);
        callback(null, md);
      } catch (err) {
        callback(err as Error);
      }
    });
    credentials = grpc.credentials.combineChannelCredentials(credentials, bearer);
  }
  return { credentials, channelOptions };
}

/**
 * Client options from the environment (for scripts and the tests):
 * KVMESH_CLIENT_CA_FILE, KVMESH_CLIENT_CERT_FILE, KVMESH_CLIENT_KEY_FILE,
 * KVMESH_CLIENT_SERVER_NAME, KVMESH_CLIENT_TOKEN_FILE. None set: plaintext.
 */
export function optionsFromEnv(env: NodeJS.ProcessEnv = process.env): ConnectionOptions {
  const tls: TlsOptions = {};
  if (env.KVMESH_CLIENT_CA_FILE) tls.caFile = env.KVMESH_CLIENT_CA_FILE;
  if (env.KVMESH_CLIENT_CERT_FILE) tls.certFile = env.KVMESH_CLIENT_CERT_FILE;
  if (env.KVMESH_CLIENT_KEY_FILE) tls.keyFile = env.KVMESH_CLIENT_KEY_FILE;
  if (env.KVMESH_CLIENT_SERVER_NAME) tls.serverName = env.KVMESH_CLIENT_SERVER_NAME;
  const options: ConnectionOptions = {};
  if (Object.keys(tls).length) options.tls = tls;
  if (env.KVMESH_CLIENT_TOKEN_FILE) {
    options.tokenFile = env.KVMESH_CLIENT_TOKEN_FILE;
    options.tls = options.tls || true;
  }
  return options;
}

/** URI schemes of gRPC's resolvers: a target starting with one is used as given. */
const TARGET_SCHEMES = ['dns:', 'ipv4:', 'ipv6:', 'unix:', 'unix-abstract:', 'vsock:', 'xds:'];

/**
 * The gRPC target of `address`: a `host:port` or a resolver URI
 * (`dns:///indexer-headless.ns.svc:50051`: every address the name resolves to)
 * as given; several replica addresses (an array, or one string joined by
 * commas) as one `ipv4:` or `ipv6:` target listing them all. Those must be IP
 * literals of one family (`[addr]:port` for IPv6): a name needs `dns:///`.
 */
export function channelTarget(address: string | readonly string[]): string {
  const parts = (Array.isArray(address) ? address : String(address).split(','))
    .map((a: string) => String(a).trim())
    .filter(Boolean);
  if (!parts.length) throw new Error('no indexer address given');
  if (!Array.isArray(address) && TARGET_SCHEMES.some((p) => String(address).trim().startsWith(p))) {
    return String(address).trim();
  }
  if (parts.length === 1) return parts[0];
  const families = parts.map((a: string) => {
    const m = /^(\[([0-9a-fA-F:.]+)\]|(\d{1,3}(?:\.\d{1,3}){3})):(\d{1,5})$/.exec(a);
    if (!m) {
      throw new Error(
        `${JSON.stringify(a)}: a list of replicas takes IP addresses (ip:port, [ipv6]:port); for a name use dns:///name:port`,
      );
    }
    return m[2] ? 'ipv6' : 'ipv4';
  });
  if (new Set(families).size > 1) throw new Error(`${parts.join(', ')}: mixes IPv4 and IPv6 addresses`);
  return `${families[0]}:${parts.join(',')}`;
}
